use super::*;
use crate::upstream::SseParser;

fn chat_chunk(content: &str, tokens: &[&str]) -> String {
    delta_chunk(&json!({ "content": content }), tokens)
}

fn reasoning_chunk(reasoning: &str, tokens: &[&str]) -> String {
    delta_chunk(&json!({ "reasoning_content": reasoning }), tokens)
}

fn delta_chunk(delta: &Value, tokens: &[&str]) -> String {
    let lp: Vec<Value> = tokens
        .iter()
        .map(|t| json!({"token": t, "logprob": -0.5, "top_logprobs": [{"token": t, "logprob": -0.5}, {"token": "zz", "logprob": -3.0}]}))
        .collect();
    let logprobs = if tokens.is_empty() {
        Value::Null
    } else {
        json!({ "content": lp })
    };
    let c = json!({"id": "c", "model": "m", "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": null}]});
    format!("data: {c}\n\n")
}

/// Feeds `events` and polls everything: (channel, text, token texts, split) per item.
fn channels(events: &[String]) -> Vec<(Channel, String, Vec<String>, Split)> {
    let mut sse = SseParser::new(1 << 16);
    let mut src = UpstreamSource::new(false);
    let mut out = Vec::new();
    for ev in events {
        sse.push(ev.as_bytes());
        while let Some(e) = sse.next_event_ref().expect("valid SSE") {
            assert!(src.push_event(Endpoint::Chat, e, 1));
        }
        while let Polled::Text(p) = src.poll() {
            let Tokens::Upstream(toks) = &p.tokens else {
                unreachable!("upstream tokens")
            };
            let toks = toks.iter().map(|t| t.text.clone()).collect();
            out.push((p.channel, p.text.to_string(), toks, p.split));
            src.recycle(p);
        }
    }
    out
}

#[test]
fn reasoning_is_its_own_channel_ahead_of_the_answer() {
    let s = |v: &[&str]| v.iter().map(|t| (*t).to_owned()).collect::<Vec<_>>();
    let (r, c) = (Channel::Reasoning, Channel::Content);
    let mixed = delta_chunk(
        &json!({"reasoning_content": " so", "content": "Yes"}),
        &[" so", "Yes"],
    );
    // Ollama's (and newer vLLM's) `reasoning` is the same channel.
    let ollama = delta_chunk(&json!({"reasoning": " hm", "content": ""}), &[" hm"]);
    let got = channels(&[
        reasoning_chunk("Let", &["Let"]),
        reasoning_chunk(" me think", &[" me", " think"]),
        reasoning_chunk("é", &[]),
        ollama,
        mixed,
        chat_chunk(" it", &[" it"]),
    ]);
    assert_eq!(
        got,
        vec![
            (r, "Let".to_owned(), s(&["Let"]), Split::Token),
            (r, " me".to_owned(), s(&[" me"]), Split::Token),
            (r, " think".to_owned(), s(&[" think"]), Split::Token),
            (r, "é".to_owned(), s(&[]), Split::Chars),
            (r, " hm".to_owned(), s(&[" hm"]), Split::Token),
            // One chunk with both: the reasoning's tokens first, then the answer's.
            (r, " so".to_owned(), s(&[" so"]), Split::Token),
            (c, "Yes".to_owned(), s(&["Yes"]), Split::Token),
            (c, " it".to_owned(), s(&[" it"]), Split::Token),
        ]
    );
}

/// Polls everything queued, recycling each text as the pipeline does; (text, token texts,
/// first token's alternatives).
fn drain(src: &mut UpstreamSource) -> Vec<(String, Vec<String>, usize)> {
    let mut out = Vec::new();
    while let Polled::Text(p) = src.poll() {
        let toks = match &p.tokens {
            Tokens::Upstream(t) => t.iter().map(|t| t.text.clone()).collect(),
            Tokens::Builtin { .. } => unreachable!("upstream tokens"),
        };
        let tops = match &p.tokens {
            Tokens::Upstream(t) => t.first().map_or(0, |t| t.top.len()),
            Tokens::Builtin { .. } => 0,
        };
        out.push((p.text.to_string(), toks, tops));
        src.recycle(p);
    }
    out
}

#[test]
fn reused_buffers_never_leak_a_previous_token() {
    let mut sse = SseParser::new(1 << 16);
    let mut src = UpstreamSource::new(false);
    let mut got = Vec::new();
    let events = [
        chat_chunk(" The", &[" The"]),
        chat_chunk(" river", &[" river"]),
        // No logprobs: the recycled token list must not lend its old tokens.
        chat_chunk(" runs", &[]),
        // Two tokens in one chunk: one item each.
        chat_chunk(" far away", &[" far", " away"]),
        // Tokens that do not spell the text: framed per character, tokens kept.
        chat_chunk("ab", &["a"]),
        chat_chunk(".", &["."]),
    ];
    for ev in &events {
        sse.push(ev.as_bytes());
        while let Some(e) = sse.next_event_ref().expect("valid SSE") {
            assert!(src.push_event(Endpoint::Chat, e, 1));
        }
        got.extend(drain(&mut src));
    }
    let s = |v: &[&str]| v.iter().map(|t| (*t).to_owned()).collect::<Vec<_>>();
    assert_eq!(
        got,
        vec![
            (" The".to_owned(), s(&[" The"]), 2),
            (" river".to_owned(), s(&[" river"]), 2),
            (" runs".to_owned(), s(&[]), 0),
            (" far".to_owned(), s(&[" far"]), 2),
            (" away".to_owned(), s(&[" away"]), 2),
            ("ab".to_owned(), s(&["a"]), 2),
            (".".to_owned(), s(&["."]), 2),
        ]
    );
    assert_eq!(src.model(), Some("m"));
}

#[test]
fn a_plain_token_allocates_nothing_once_warm() {
    const WORDS: &[&str] = &[" The", " river", " x", " é", " 東京", " runs", ".", " 42"];
    // Runs of reasoning and answer tokens: a reasoning token swaps buffers as a content
    // token does, and allocates nothing either.
    let events: Vec<String> = (0..400)
        .map(|i| {
            let w = WORDS[i % WORDS.len()];
            if (i / 7) % 2 == 0 {
                reasoning_chunk(w, &[w])
            } else {
                chat_chunk(w, &[w])
            }
        })
        .collect();
    let mut sse = SseParser::new(1 << 16);
    let mut src = UpstreamSource::new(false);
    let mut run = |evs: &[String]| {
        let mut frames = 0;
        for ev in evs {
            sse.push(ev.as_bytes());
            while let Some(e) = sse.next_event_ref().expect("valid SSE") {
                assert!(src.push_event(Endpoint::Chat, e, 1));
            }
            while let Polled::Text(p) = src.poll() {
                assert_eq!(p.tokens.len(), 1);
                frames += 1;
                src.recycle(p);
            }
        }
        frames
    };
    // Warm-up: the reader's and the spares' buffers grow to the words' sizes.
    run(&events[..100]);
    let before = crate::upstream::alloc_tests::allocs();
    let frames = run(&events[100..]);
    let n = crate::upstream::alloc_tests::allocs() - before;
    assert_eq!(frames, 300);
    assert_eq!(n, 0, "{n} allocations for {frames} tokens");
}

#[test]
fn tool_call_deltas_merge_by_index() {
    let mut tools = Vec::new();
    let s1 = merge_tool_calls(
        &mut tools,
        &json!([{"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ""}}]),
    );
    assert_eq!(s1.len(), 1);
    assert_eq!(s1[0]["name"], "get_weather");
    let s2 = merge_tool_calls(
        &mut tools,
        &json!([{"index": 0, "function": {"arguments": "{\"city\":"}}]),
    );
    assert!(s2.is_empty());
    merge_tool_calls(
        &mut tools,
        &json!([{"index": 0, "function": {"arguments": "\"Oslo\"}"}}]),
    );
    let s3 = merge_tool_calls(
        &mut tools,
        &json!([{"index": 1, "id": "call_2", "function": {"name": "f", "arguments": "{}"}}]),
    );
    assert_eq!(s3[0]["index"], 1);
    assert_eq!(tools[0]["function"]["arguments"], "{\"city\":\"Oslo\"}");
    assert_eq!(tools[1]["id"], "call_2");
}

/// llama.cpp's server repeats the id and the whole name in every delta: the name stays one
/// name (it came back as `get_weatherget_weather…`), the arguments still join.
#[test]
fn a_name_repeated_in_every_delta_is_one_name() {
    let mut tools = Vec::new();
    let mut started = 0;
    for piece in ["", "{\"city\":", "\"Oslo\"}"] {
        let d = json!([{"index": 0, "id": "call__0_get_weather_cmpl-1", "type": "function",
                        "function": {"name": "get_weather", "arguments": piece}}]);
        started += merge_tool_calls(&mut tools, &d).len();
    }
    assert_eq!(started, 1);
    assert_eq!(tools.len(), 1);
    assert_eq!(tools[0]["function"]["name"], "get_weather");
    assert_eq!(tools[0]["function"]["arguments"], "{\"city\":\"Oslo\"}");
    // A name sent in pieces still joins.
    let mut split = Vec::new();
    merge_tool_calls(
        &mut split,
        &json!([{"index": 0, "id": "c", "function": {"name": "get_"}}]),
    );
    merge_tool_calls(
        &mut split,
        &json!([{"index": 0, "function": {"name": "weather"}}]),
    );
    assert_eq!(split[0]["function"]["name"], "get_weather");
}
