//! Proxied turns through the pipeline's own steps, as an ordinary user, with the driver of
//! `tests.rs`: the upstream's SSE bytes arrive split into receives at random and go
//! through the real parser and `UpstreamSource`; tokens one receive brought share a frame,
//! text without logprobs goes out one character per frame through the hold queue; and
//! TokenCircuit holds a tool call's deltas until the call is complete and judged
//! (`release_tool_delta`, `circuit.rs` `judge_held`), so a forbidden call halts the stream
//! before any byte of it reached the client.

use std::sync::atomic::Ordering::SeqCst;

use proptest::prelude::*;

use super::tests::{client_view, drive_with, schedule, Driver, Schedule, FINAL, TERMINAL};
use crate::{
    dataplane::turn::TurnSource,
    wire::{ClientRequest, Endpoint},
};

/// One upstream token: its text, and whether its chunk carries logprobs (without them, the
/// pipeline cuts the text into one frame per character through the hold queue).
fn up_chunk(text: &str, logprobs: bool) -> String {
    let lp = if logprobs {
        format!(r#"{{"content":[{{"token":{text:?},"logprob":-0.1,"top_logprobs":[]}}]}}"#)
    } else {
        "null".to_owned()
    };
    format!(
        "data: {{\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":0,\"model\":\"m\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":{text:?}}},\"logprobs\":{lp},\"finish_reason\":null}}]}}\n\n"
    )
}

/// The upstream's final chunk (`finish_reason`) and `[DONE]`.
fn up_end(finish: &str) -> String {
    format!(
        "data: {{\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":0,\"model\":\"m\",\"choices\":[{{\"index\":0,\"delta\":{{}},\"finish_reason\":{finish:?}}}]}}\n\ndata: [DONE]\n\n"
    )
}

/// A proxied streaming chat turn whose upstream sends `stream`, its bytes cut at `cuts` (each
/// a fraction of the rest, in 256ths) into receives.
fn open_stream(s: &Schedule, stream: &[u8], cuts: &[u8]) -> Driver {
    let body = r#"{"model":"m","stream":true,"logprobs":true,"messages":[{"role":"user","content":"hi"}]}"#;
    let req = ClientRequest::parse(Endpoint::Chat, body.as_bytes()).expect("a valid request");
    let ask = req.builtin_turn("m").expect("a valid ask").ask;
    let mut feed = std::collections::VecDeque::new();
    let mut rest = stream;
    for &c in cuts.iter().cycle() {
        if rest.is_empty() {
            break;
        }
        let n = (rest.len() * usize::from(c) / 256).max(1);
        feed.push_back(rest[..n].to_vec());
        rest = &rest[n..];
    }
    let source = TurnSource::Upstream(crate::source::upstream::UpstreamSource::new(false));
    Driver::open(s, source, &ask, feed)
}

/// A proxied turn whose upstream sends `tokens` (text, with logprobs?), then its final chunk.
fn open_proxied(s: &Schedule, tokens: &[(String, bool)], cuts: &[u8]) -> (Driver, String) {
    let mut stream = String::new();
    for (text, lp) in tokens {
        stream.push_str(&up_chunk(text, *lp));
    }
    stream.push_str(&up_end("stop"));
    let expected = tokens.iter().map(|(t, _)| t.as_str()).collect();
    (open_stream(s, stream.as_bytes(), cuts), expected)
}

fn upstream_tokens() -> impl Strategy<Value = Vec<(String, bool)>> {
    prop::collection::vec(
        (
            prop::sample::select(vec![" the", " tide", " é", " moon", "\n", " 42", "!"]),
            prop::bool::weighted(0.7),
        ),
        1..30,
    )
    .prop_map(|v| v.into_iter().map(|(t, lp)| (t.to_owned(), lp)).collect())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// A proxied turn, its upstream's bytes split into receives at random: tokens an upstream
    /// receive brought together share a frame (staging), text without logprobs goes out one
    /// character per frame (the hold queue), under random sends, trips and closes.
    #[test]
    fn a_proxied_turn_keeps_its_order_and_its_bound_however_the_bytes_arrive(
        s in schedule(),
        tokens in upstream_tokens(),
        cuts in prop::collection::vec(1u8..=255, 1..12),
    ) {
        let (mut d, expected) = open_proxied(&s, &tokens, &cuts);
        drive_with(&s, &mut d, |_| {});
        let slot = d.slot();
        let (texts, tail) = client_view(&d.wire);
        let got: String = texts.concat();
        prop_assert_eq!(d.sends_after_close, 0);
        prop_assert!(expected.starts_with(&got), "{:?} is not a prefix of {:?}", got, expected);
        prop_assert!(slot.tokens_delivered.load(SeqCst) <= slot.tokens_submitted.load(SeqCst));
        if let Some(tau) = d.tripped_tokens {
            prop_assert_eq!(slot.trip_token_index.load(SeqCst), tau);
            prop_assert_eq!(slot.post_trip_delivered.load(SeqCst), 0);
            prop_assert!(slot.tokens_delivered.load(SeqCst) <= tau + u64::from(s.budget));
            prop_assert_eq!(d.finals, 0);
            if !d.conn.closing {
                prop_assert_eq!(d.terminals, 1);
                prop_assert_eq!(tail.as_slice(), TERMINAL);
            }
        } else if !d.conn.closing {
            prop_assert_eq!(&got, &expected);
            prop_assert_eq!((d.finals, d.terminals), (1, 0));
            prop_assert_eq!(tail.as_slice(), FINAL);
        }
    }
}

#[test]
fn tokens_one_receive_brought_share_a_frame_and_text_without_logprobs_goes_per_character() {
    let s = Schedule {
        tokens: 0,
        takes: vec![8],
        trip_at: None,
        trip_mid_step: false,
        close_at: None,
        hold_back: None,
        budget: 5,
    };
    let tokens: Vec<(String, bool)> = [
        (" the", true),
        (" tide", true),
        (" moon", true),
        ("ab", false),
    ]
    .iter()
    .map(|(t, lp)| ((*t).to_owned(), *lp))
    .collect();
    // Everything but the stream's last bytes in the first receive.
    let (mut d, expected) = open_proxied(&s, &tokens, &[255]);
    drive_with(&s, &mut d, |_| {});
    let (texts, tail) = client_view(&d.wire);
    assert_eq!(texts, [" the", " tide", " moon", "a", "b"]);
    assert_eq!(texts.concat(), expected);
    assert_eq!(tail, FINAL);
    // One frame for the three staged tokens, one per character, and the final frame.
    assert_eq!(d.slot().frames_submitted.load(SeqCst), 1 + 2 + 1);
    assert_eq!(d.slot().tokens_delivered.load(SeqCst), 5);
}

/// One tool call the upstream streams: its name, its arguments in pieces, and whether its
/// first delta carries an id (a call without one cannot be judged: TokenCircuit denies it).
#[derive(Debug, Clone)]
struct UpCall {
    name: &'static str,
    pieces: Vec<&'static str>,
    has_id: bool,
}

/// A tool-call delta of call `index`: its first piece with the call's id and name.
fn up_tool_chunk(index: usize, call: &UpCall, piece: usize) -> String {
    let mut c = serde_json::json!({"index": index, "function": {"arguments": call.pieces[piece]}});
    if piece == 0 {
        c["function"]["name"] = call.name.into();
        if call.has_id {
            c["id"] = format!("call_{index}").into();
            c["type"] = "function".into();
        }
    }
    let chunk = serde_json::json!({"id": "c", "object": "chat.completion.chunk", "created": 0,
        "model": "m", "choices": [{"index": 0, "delta": {"tool_calls": [c]},
        "logprobs": null, "finish_reason": null}]});
    format!("data: {chunk}\n\n")
}

/// A proxied turn with TokenCircuit on (a fresh conversation, the default policy): the
/// upstream says `text`, then streams `calls` one piece per chunk.
fn open_with_calls(s: &Schedule, text: &[&str], calls: &[UpCall], cuts: &[u8]) -> Driver {
    let mut stream = String::new();
    for t in text {
        stream.push_str(&up_chunk(t, true));
    }
    for (i, call) in calls.iter().enumerate() {
        for piece in 0..call.pieces.len() {
            stream.push_str(&up_tool_chunk(i, call, piece));
        }
    }
    stream.push_str(&up_end("tool_calls"));
    let mut d = open_stream(s, stream.as_bytes(), cuts);
    let store = crate::circuit::store::ConversationStore::new(4);
    let at = crate::dataplane::turn::circuit::Arrival {
        store: &store,
        header: None,
        key: crate::modes::KeyId(7),
        now: std::time::Instant::now(),
    };
    let policy = std::sync::Arc::new(crate::circuit::CircuitPolicy::default());
    let request = serde_json::json!({"messages": [{"role": "user", "content": "find it"}]});
    let tc = crate::dataplane::turn::circuit::TurnCircuit::of_request(&policy, &request, &at)
        .expect("a transcript haltd replays");
    d.conn.turn.as_mut().expect("a turn").circuit = Some(Box::new(tc));
    d.circuits = Some(store);
    d
}

/// What the client got: the content, each tool call's arguments by index (in the order
/// their first delta came), and what followed the last event.
fn tool_view(wire: &[u8]) -> (String, Vec<(u64, String)>, Vec<u8>) {
    let (mut content, mut calls) = (String::new(), Vec::<(u64, String)>::new());
    let mut rest = wire;
    while let Some(end) = rest.windows(2).position(|w| w == b"\n\n") {
        let event = std::str::from_utf8(&rest[..end]).expect("UTF-8 events");
        let json = event.strip_prefix("data: ").expect("an SSE data event");
        let v: serde_json::Value = serde_json::from_str(json).expect("a JSON chunk");
        let delta = &v["choices"][0]["delta"];
        content.push_str(delta["content"].as_str().unwrap_or(""));
        for c in delta["tool_calls"].as_array().into_iter().flatten() {
            let index = c["index"].as_u64().expect("a call's index");
            let args = c["function"]["arguments"].as_str().unwrap_or("");
            match calls.iter_mut().find(|(i, _)| *i == index) {
                Some((_, a)) => a.push_str(args),
                None => calls.push((index, args.to_owned())),
            }
        }
        rest = &rest[end + 2..];
    }
    (content, calls, rest.to_vec())
}

/// A tool call on the wire that was not complete yet (the upstream has not started a later
/// call, and the text has not ended), if any: its index.
fn sent_before_complete(d: &Driver) -> Option<u64> {
    let turn = d.conn.turn.as_ref()?;
    let started = turn.source.upstream().map_or(0, |u| u.tool_calls().len()) as u64;
    let (_, got, _) = tool_view(&d.wire);
    got.iter()
        .map(|&(index, _)| index)
        .find(|&index| index + 1 >= started && !turn.hold.ending)
}

fn up_calls() -> impl Strategy<Value = Vec<UpCall>> {
    let call = (
        prop::sample::select(vec!["search", "fetch"]),
        prop::collection::vec(
            prop::sample::select(vec!["{\"q\":", "\"tides\"", "}", "1"]),
            1..4,
        ),
        prop::bool::weighted(0.8),
    )
        .prop_map(|(name, pieces, has_id)| UpCall {
            name,
            pieces,
            has_id,
        });
    prop::collection::vec(call, 1..4)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// TokenCircuit holds each tool call until it is complete and judged: the calls before
    /// the first one it denies go out whole and in order, and not a byte of the denied call
    /// or of any after it reaches the client; the stream halts with exactly one terminal.
    /// Under random receives, sends, trips and closes.
    #[test]
    fn a_held_call_goes_out_whole_once_judged_and_a_denied_one_never(
        s in schedule(),
        calls in up_calls(),
        cuts in prop::collection::vec(1u8..=255, 1..12),
    ) {
        let text = [" the", " tide"];
        let mut d = open_with_calls(&s, &text, &calls, &cuts);
        let mut early = None;
        drive_with(&s, &mut d, |d| {
            early = early.or(sent_before_complete(d));
        });
        prop_assert_eq!(early, None, "a call went out before it was complete");
        let (content, got, tail) = tool_view(&d.wire);
        let denied = calls.iter().position(|c| !c.has_id);
        let allowed = denied.unwrap_or(calls.len());
        prop_assert_eq!(d.sends_after_close, 0);
        prop_assert!(text.concat().starts_with(&content));
        for (k, (index, args)) in got.iter().enumerate() {
            prop_assert_eq!(*index, k as u64, "calls in order");
            prop_assert!(k < allowed, "a byte of call {} reached the client: {:?}", k, got);
            let whole = calls[k].pieces.concat();
            prop_assert!(whole.starts_with(args.as_str()), "{:?} of {:?}", args, whole);
            if k + 1 < got.len() {
                prop_assert_eq!(args, &whole, "a call goes out whole before the next starts");
            }
        }
        let slot = d.slot();
        if let Some(tau) = d.tripped_tokens {
            prop_assert_eq!(slot.post_trip_delivered.load(SeqCst), 0);
            prop_assert!(slot.tokens_delivered.load(SeqCst) <= tau);
            prop_assert_eq!(d.finals, 0);
            if !d.conn.closing {
                prop_assert_eq!(d.terminals, 1);
                prop_assert_eq!(tail.as_slice(), TERMINAL);
            }
        } else if !d.conn.closing {
            prop_assert!(denied.is_none(), "a denied call halts the stream");
            prop_assert_eq!(content, text.concat());
            let whole: Vec<String> = calls.iter().map(|c| c.pieces.concat()).collect();
            prop_assert_eq!(got.into_iter().map(|(_, a)| a).collect::<Vec<_>>(), whole);
            prop_assert_eq!((d.finals, d.terminals), (1, 0));
            prop_assert_eq!(tail.as_slice(), FINAL);
        }
        if denied.is_some() && s.trip_at.is_none() && s.close_at.is_none() {
            // The incident record, as the daemon builds it from the slot.
            let kind = crate::ledger::RecordKind::Incident;
            let rec = crate::halt::base_record(kind, &slot.snapshot(d.conn.id.slot), "off");
            prop_assert_eq!(rec.trip_cause.as_deref(), Some("TOOL_CIRCUIT_OPEN"));
            prop_assert_eq!(rec.trip_token_index, d.tripped_tokens);
            prop_assert_eq!(rec.halt_tokens_post_trip, Some(0));
        }
    }
}

#[test]
fn a_call_goes_out_once_the_next_starts_and_one_without_an_id_never() {
    let s = Schedule {
        tokens: 0,
        takes: vec![8],
        trip_at: None,
        trip_mid_step: false,
        close_at: None,
        hold_back: None,
        budget: 5,
    };
    let call = |has_id| UpCall {
        name: "search",
        pieces: vec!["{\"q\":", "\"tides\"", "}"],
        has_id,
    };
    let calls = [call(true), call(false)];
    // Receives of a few bytes: each delta is released or held before the next arrives.
    let mut d = open_with_calls(&s, &[" the"], &calls, &[1]);
    let mut early = None;
    drive_with(&s, &mut d, |d| {
        early = early.or(sent_before_complete(d));
    });
    assert_eq!(early, None, "call 0 waited for call 1 to start");
    let (content, got, tail) = tool_view(&d.wire);
    assert_eq!(content, " the");
    assert_eq!(got, [(0, "{\"q\":\"tides\"}".to_owned())]);
    assert_eq!(tail, TERMINAL);
    assert_eq!(d.terminals, 1);
}
