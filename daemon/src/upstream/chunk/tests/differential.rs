//! The typed read against the reference (the `Value` read it replaced): on generated chunks,
//! well-formed and not (wrong kinds anywhere, keys in any order and given twice, escapes,
//! numbers out of range, truncated text), both give the same event or the same error; and a
//! [`ChunkReader`] reading a stream of them gives each the same chunk (its reuse leaks
//! nothing from one chunk into the next).

use proptest::{prelude::*, sample::Index};

use super::{reference, ChunkReader, Endpoint, Parsed, SseEvent, UpstreamEvent};

fn lit(items: &'static [&'static str]) -> BoxedStrategy<String> {
    proptest::sample::select(items)
        .prop_map(str::to_owned)
        .boxed()
}

/// A value of a kind no field here expects, or of every kind.
fn wrong() -> BoxedStrategy<String> {
    lit(&[
        "null",
        "true",
        "1",
        "-1",
        "1.5",
        "\"s\"",
        "[]",
        "{}",
        "[1,\"a\",null]",
        "{\"k\":[null]}",
        "[[[[]]]]",
    ])
}

/// Text that is no JSON a `Value` takes: both reads must fail alike wherever it is.
fn breaker() -> BoxedStrategy<String> {
    lit(&["1e400", "\"\\ud800\"", "-1e999"])
}

fn or_wrong(good: BoxedStrategy<String>) -> BoxedStrategy<String> {
    prop_oneof![12 => good, 1 => wrong()].boxed()
}

fn text() -> BoxedStrategy<String> {
    prop_oneof![
        "[a-c é\"\\\\\n€]{0,5}".prop_map(|s| serde_json::to_string(&s).expect("string")),
        lit(&["\"\\u0061b\"", "\"\\ud83d\\ude00\"", "\"\"", "\"[DONE]\""]),
    ]
    .boxed()
}

fn logprob() -> BoxedStrategy<String> {
    prop_oneof![
        1 => lit(&[
            "-0.5", "0.5", "-9999.0", "-9998.5", "null", "\"-0.1\"", "true", "[-1.0]",
            "{\"a\":1}", "0", "5e-7", "-1e300", "-3", "18446744073709551615", "-0",
        ]),
        4 => (-20.0f64..0.0).prop_map(|x| x.to_string()),
    ]
    .boxed()
}

/// An object of `fields`, each there with its probability, in any order; now and then one
/// given twice (the second value wins in a `Value`), and an unknown key.
fn object(fields: Vec<(&'static str, f64, BoxedStrategy<String>)>) -> BoxedStrategy<String> {
    let mut parts: Vec<BoxedStrategy<Option<String>>> = Vec::new();
    for (k, p, v) in fields {
        let entry = v.prop_map(move |v| format!("\"{k}\":{v}")).boxed();
        parts.push(proptest::option::weighted(p, entry.clone()).boxed());
        parts.push(proptest::option::weighted(0.04, entry).boxed());
    }
    parts.push(proptest::option::weighted(0.2, wrong().prop_map(|v| format!("\"x\":{v}"))).boxed());
    parts
        .prop_map(|f| f.into_iter().flatten().collect::<Vec<_>>())
        .prop_shuffle()
        .prop_map(|f| format!("{{{}}}", f.join(",")))
        .boxed()
}

fn array(item: BoxedStrategy<String>, len: std::ops::Range<usize>) -> BoxedStrategy<String> {
    proptest::collection::vec(item, len)
        .prop_map(|v| format!("[{}]", v.join(",")))
        .boxed()
}

fn chat_logprobs() -> BoxedStrategy<String> {
    let alt = or_wrong(object(vec![
        ("token", 0.95, or_wrong(text())),
        ("logprob", 0.9, logprob()),
        ("bytes", 0.3, wrong()),
    ]));
    let entry = or_wrong(object(vec![
        ("token", 0.95, or_wrong(text())),
        ("logprob", 0.9, logprob()),
        ("top_logprobs", 0.7, or_wrong(array(alt, 0..23))),
        ("id", 0.2, wrong()),
    ]));
    or_wrong(array(entry, 0..4))
}

fn completion_logprobs() -> Vec<(&'static str, f64, BoxedStrategy<String>)> {
    let top_map = proptest::collection::vec(("[ab]{1,2}", logprob()), 0..25)
        .prop_map(|kv| {
            let f: Vec<String> = kv.iter().map(|(k, v)| format!("\"{k}\":{v}")).collect();
            format!("{{{}}}", f.join(","))
        })
        .boxed();
    vec![
        ("tokens", 0.5, or_wrong(array(or_wrong(text()), 1..3))),
        ("token_logprobs", 0.5, or_wrong(array(logprob(), 1..3))),
        (
            "top_logprobs",
            0.5,
            or_wrong(array(or_wrong(top_map), 1..3)),
        ),
        ("text_offset", 0.2, wrong()),
    ]
}

fn choice() -> BoxedStrategy<String> {
    let delta = or_wrong(object(vec![
        ("role", 0.2, or_wrong(text())),
        ("content", 0.8, or_wrong(text())),
        ("reasoning_content", 0.2, or_wrong(text())),
        ("reasoning", 0.2, or_wrong(text())),
        (
            "tool_calls",
            0.1,
            lit(&["null", "[{\"index\":0,\"id\":\"c\"}]", "7"]),
        ),
    ]));
    let mut lp_fields = completion_logprobs();
    lp_fields.push(("content", 0.5, chat_logprobs()));
    let logprobs = prop_oneof![1 => Just("null".to_owned()), 6 => or_wrong(object(lp_fields))];
    let finish = or_wrong(lit(&["null", "\"stop\"", "\"eos\"", "\"abort\"", "\"x\""]));
    let index = prop_oneof![
        8 => lit(&["0", "1", "null"]),
        1 => lit(&["4294967296", "-1", "1.0"]),
    ];
    or_wrong(object(vec![
        ("index", 0.8, index.boxed()),
        ("y", 0.01, breaker()),
        ("finish_reason", 0.5, finish),
        ("delta", 0.7, delta),
        ("text", 0.5, or_wrong(text())),
        ("logprobs", 0.8, logprobs.boxed()),
    ]))
}

fn chunk_text() -> BoxedStrategy<String> {
    let usage = or_wrong(object(vec![
        (
            "prompt_tokens",
            0.9,
            or_wrong(lit(&["0", "12", "18446744073709551615"])),
        ),
        ("completion_tokens", 0.9, or_wrong(lit(&["3", "1.0", "-2"]))),
    ]));
    let top = object(vec![
        ("id", 0.7, or_wrong(text())),
        ("model", 0.7, or_wrong(text())),
        ("usage", 0.15, usage),
        (
            "choices",
            0.95,
            prop_oneof![
                1 => or_wrong(array(choice(), 0..3)),
                6 => array(choice(), 1..2),
            ]
            .boxed(),
        ),
        (
            "error",
            0.03,
            lit(&["null", "{\"message\":\"m\",\"code\":503}", "\"e\"", "{}"]),
        ),
        (
            "object",
            0.3,
            prop_oneof![
                1 => lit(&["\"error\"", "null"]),
                8 => Just("\"chat.completion.chunk\"".to_owned()),
            ]
            .boxed(),
        ),
        ("created", 0.3, wrong()),
    ]);
    prop_oneof![40 => top, 1 => wrong()].boxed()
}

/// A generated chunk, now and then cut short.
fn event_data() -> impl Strategy<Value = String> {
    (chunk_text(), any::<Index>(), 0..20u8).prop_map(|(mut s, at, cut)| {
        if cut == 0 {
            s.truncate(s.floor_char_boundary(at.index(s.len() + 1)));
        }
        s
    })
}

fn ev(data: String) -> SseEvent {
    SseEvent {
        data,
        ..SseEvent::default()
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1500))]

    #[test]
    fn typed_read_matches_the_value_read(data in event_data()) {
        let e = ev(data);
        for endpoint in [Endpoint::Chat, Endpoint::Completion] {
            prop_assert_eq!(
                super::parse_event(endpoint, &e),
                reference::parse_event(endpoint, &e),
                "{:?} {}", endpoint, e.data
            );
        }
    }

    #[test]
    fn a_reused_reader_reads_each_chunk_afresh(
        stream in proptest::collection::vec(event_data(), 1..12),
        chat in any::<bool>(),
    ) {
        let endpoint = if chat { Endpoint::Chat } else { Endpoint::Completion };
        let mut reader = ChunkReader::default();
        for data in stream {
            let e = ev(data);
            let got = reader.read(endpoint, e.view()).map(|p| match p {
                Parsed::Chunk => UpstreamEvent::Chunk(reader.chunk().clone()),
                Parsed::Done => UpstreamEvent::Done,
                Parsed::Error(err) => UpstreamEvent::Error(err),
            });
            prop_assert_eq!(got, reference::parse_event(endpoint, &e), "{}", e.data);
        }
    }
}

/// Cases the property tests found, kept: every array's kind is checked before any length, and
/// a key given twice leaves nothing of its first value behind.
#[test]
fn found_cases() {
    let cases = [
        r#"{"choices":[{"logprobs":{"top_logprobs":true,"token_logprobs":[-0.5],"tokens":[]}}]}"#,
        r#"{"choices":[{"logprobs":{"tokens":[""],"token_logprobs":[-0.5,-0.5],"top_logprobs":true}}]}"#,
        r#"{"choices":[{"logprobs":{"token_logprobs":[-0.5],"top_logprobs":[{}],"content":[{"top_logprobs":[{"token":"a"}]}],"content":[{"token":""}]}}]}"#,
        r#"{"id":"a","id":7,"model":"m","choices":[{"delta":{"content":"x"},"delta":null}]}"#,
        r#"{"choices":[{"text":"ab","logprobs":{"tokens":["a","b"],"token_logprobs":[-1,-2],"token_logprobs":null,"top_logprobs":[{"x":-1,"x":0.5},{"y":-1,"y":"z","y":-2}]}}]}"#,
        r#"{"choices":[{"text":"ab","logprobs":{"tokens":["a","b"],"top_logprobs":[{"x":-1,"x":-3},{"y":"z","y":-2}]}}]}"#,
    ];
    let mut reader = ChunkReader::default();
    for data in cases {
        for endpoint in [Endpoint::Chat, Endpoint::Completion] {
            let e = ev(data.to_owned());
            let want = reference::parse_event(endpoint, &e);
            assert_eq!(
                super::parse_event(endpoint, &e),
                want,
                "{endpoint:?} {data}"
            );
            let got = reader.read(endpoint, e.view()).map(|p| match p {
                Parsed::Chunk => UpstreamEvent::Chunk(reader.chunk().clone()),
                Parsed::Done => UpstreamEvent::Done,
                Parsed::Error(err) => UpstreamEvent::Error(err),
            });
            assert_eq!(got, want, "reused, {endpoint:?} {data}");
        }
    }
}
